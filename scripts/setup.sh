#!/usr/bin/env bash
# Sourced by main.sh and test.sh: create .venv in the checkout (once) and install xroute with every
# dependency pinned by constraints.txt (torch: the CPU wheel), then quiet the services' telemetry.
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
export MLFLOW_DISABLE_TELEMETRY=true RAY_USAGE_STATS_ENABLED=0
