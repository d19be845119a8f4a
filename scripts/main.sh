#!/usr/bin/env bash
# Set up a virtual environment and run xroute's main job on the embedded defaults: the shipped
# telemetry bundle, every baseline and the hindsight oracle compared on the same request stream.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
export MLFLOW_DISABLE_TELEMETRY=true RAY_USAGE_STATS_ENABLED=0
.venv/bin/xroute evaluate \
  --policy static --policy cheapest --policy lowest-latency --policy least-loaded \
  --policy greedy --policy round-robin --policy random --policy oracle \
  --output reports/evaluate.json --plot reports/evaluate.png
