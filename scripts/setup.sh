#!/usr/bin/env bash
# Sourced by main.sh and test.sh: create .venv in the checkout (once) and install xroute with every
# dependency pinned by constraints.txt (torch: the CPU wheel), then quiet the services' telemetry.
# With XROUTE_TEST_SERVERS=1 (test.sh) it also installs the servers the tests start for real --
# Debian's redis-server and postgresql -- and Debian's prometheus, for its promtool (the alert rules'
# tests: tests/test_dashboards.py), and Debian's chromium and chromium-driver (the web console's browser
# tests: tests/test_console.py), when their programs are missing (apt is skipped otherwise).
if [ "${XROUTE_TEST_SERVERS:-0}" = 1 ]; then
  _need=""
  command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || _need="$_need redis-server"
  command -v pg_ctl >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || _need="$_need postgresql"
  command -v promtool >/dev/null 2>&1 || _need="$_need prometheus"
  command -v chromium >/dev/null 2>&1 || _need="$_need chromium"
  command -v chromedriver >/dev/null 2>&1 || _need="$_need chromium-driver"
  if [ -n "$_need" ]; then
    echo "setup: installing the tests' servers:$_need (Debian packages)"
    _sudo=""
    if [ "$(id -u)" != 0 ]; then _sudo="sudo"; fi
    $_sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null \
      && $_sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $_need >/dev/null \
      || echo "setup: could not install$_need; the tests that need them will fail saying so" >&2
  fi
  unset _need _sudo
fi
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
echo "setup: installing xroute and its pinned dependencies into .venv (a few minutes the first time) ..."
.venv/bin/python -m pip install -q --upgrade pip
# (PYTHONWARNINGS: setuptools prints a 30-line "Editable installation" notice, information only, for
# every editable install whose packages map folders -- ours do: configs/ and data/bundles/)
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
echo "setup: done"
export MLFLOW_DISABLE_TELEMETRY=true RAY_USAGE_STATS_ENABLED=0
