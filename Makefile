# Developer shortcuts. The README's two commands are the source of truth for users and CI.
PY ?= .venv/bin/python

.PHONY: setup test test-fast lint bundle bench

setup:
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q -c constraints.txt -e '.[dev]'

test:
	$(PY) -m pytest -q

test-fast:  ## skips the slow tier (CI runs everything)
	$(PY) -m pytest -q -m "not slow"

lint:  ## ruff, mypy, the import contracts of pyproject.toml and router/'s function lengths (docs/architecture.md)
	.venv/bin/ruff check .
	.venv/bin/mypy
	.venv/bin/lint-imports --no-logo
	.venv/bin/python tools/function_length.py

bundle:  ## rebuild the shipped bundle from ../shared/data (deterministic)
	$(PY) tools/build_default_bundle.py --shared ../shared/data --out data/bundles/default

bench:
	$(PY) benchmarks/bench_env.py
