#!/usr/bin/env bash
# Set up a virtual environment (CPU torch pinned through constraints.txt), install the servers the
# tests start for real (Debian's redis-server and postgresql, when missing) and run the whole test
# suite, slow tier included. This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
XROUTE_TEST_SERVERS=1 source scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
