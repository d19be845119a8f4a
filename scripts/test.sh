#!/usr/bin/env bash
# Set up a virtual environment (CPU torch pinned through constraints.txt) and run the whole test
# suite, slow tier included. This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
