"""One full telemetry collection over the local cloud stand-ins: calls, wall time, concurrency.

    .venv/bin/python benchmarks/bench_collect.py [--regions-per-provider 3] [--concurrency 1,8]

Starts moto's server and the recorded-payload servers on loopback (nothing leaves the machine),
points the adapters at them, and runs one collection per concurrency level into a fresh bundle
directory, each with fresh adapters (cold caches), after one warm-up request to moto. Prints a
table and writes ``benchmarks/results/collect.json``. The servers answer in microseconds, so the
figures measure the collector's own cost (SDK clients, parsing, merging, validating, fsync'd
writes) rather than the clouds' latency.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from cloud_adapters.collect.config import CollectConfig  # noqa: E402
from cloud_adapters.collect.run import collect_once  # noqa: E402
from cloud_adapters.registry import get_adapter  # noqa: E402
from tests.clouds import local_clouds  # noqa: E402

REGIONS = {
    "aws": ["us-east-1", "us-west-2", "eu-west-1", "us-east-2"],
    "azure": ["eastus", "westeurope", "japaneast", "uksouth"],
    "gcp": ["us-central1", "europe-west4", "us-east1", "europe-west1"],
}
FAST = {"backoff_initial_s": 0.05, "timeout_s": 10.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regions-per-provider", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8", help="comma-separated concurrency levels")
    ap.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "collect.json")
    args = ap.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    regions = {p: rs[: args.regions_per_provider] for p, rs in REGIONS.items()}
    levels = [int(c) for c in args.concurrency.split(",")]
    runs = []
    with local_clouds() as clouds:
        os.environ.update(clouds.env)
        # the warm-up: moto loads its instance-type catalog on first use
        get_adapter("aws", {"instance_types": ["g5.xlarge"]}).offerings("us-east-1")
        for conc in levels:
            clouds.reset()
            with tempfile.TemporaryDirectory() as tmp:
                cfg = CollectConfig(
                    providers=list(regions), regions=regions, out=Path(tmp) / "bundle", origin="aws:us-east-1",
                    concurrency=conc, deadline_s=120, rtt_probes=5, rtt_timeout_s=1.0,
                    provider_options={"aws": {**FAST, "spot_placement_scores": True,
                                              "instance_families": ["g4dn", "g5", "g6", "p4d", "p5"]},
                                      "azure": FAST, "gcp": FAST})
                t0 = time.perf_counter()
                report = collect_once(cfg)
                wall = time.perf_counter() - t0
                rows = {k: v for k, v in report.record["rows_added"].items()}
            server_hits = {s.name: s.total_hits for s in clouds.servers}
            runs.append({
                "concurrency": conc, "wall_s": round(wall, 3), "api_calls": report.calls,
                "api_calls_by_provider": report.record["calls"], "http_requests_served": server_hits,
                "retries": report.record["retries"], "stale_sources": report.record["stale"],
                "sources": len(report.sources), "rows_written": rows,
                "regions": sum(len(r) for r in regions.values()),
            })
    result = {
        "benchmark": "one full collection over local stand-ins (moto + recorded payloads)",
        "command": "python benchmarks/bench_collect.py " + " ".join(sys.argv[1:]),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "regions": regions, "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    t = Table(title=f"collect: {sum(len(r) for r in regions.values())} regions, 3 providers, "
                    f"{os.cpu_count()} cores", title_justify="left")
    for col in ("concurrency", "wall s", "API calls", "aws/azure/gcp", "HTTP served", "stale", "rows written"):
        t.add_column(col, justify="right")
    for r in runs:
        c = r["api_calls_by_provider"]
        t.add_row(str(r["concurrency"]), f"{r['wall_s']:.2f}", str(r["api_calls"]),
                  f"{c.get('aws', 0)}/{c.get('azure', 0)}/{c.get('gcp', 0)}",
                  str(sum(r["http_requests_served"].values())), str(len(r["stale_sources"])),
                  str(sum(r["rows_written"].values())))
    Console(width=140).print(t)
    print(f"wrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")


if __name__ == "__main__":
    main()
