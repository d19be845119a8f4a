#!/usr/bin/env bash
# Set up a virtual environment (CPU torch pinned through constraints.txt) and run the whole test
# suite, slow tier included. This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
export MLFLOW_DISABLE_TELEMETRY=true RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
