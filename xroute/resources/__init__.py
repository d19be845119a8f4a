"""What xroute ships besides code, found the same way in a checkout, an editable install and a wheel.

The files stay where a developer looks for them -- ``configs/*.yaml`` and ``data/bundles/<name>/``
at the top of the repository -- and ``pyproject.toml`` installs them as the packages
``xroute.resources.configs``, ``xroute.resources.bundles`` and ``xroute.resources.catalogs`` (``package-dir``), so code reads them
through :mod:`importlib.resources`, never through a path relative to the source tree. Paths a user
passes are resolved against the user's working directory, never against these.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def configs_dir() -> Path:
    """The shipped configuration files (``configs/`` in a checkout)."""
    return Path(str(files("xroute.resources.configs")))


def bundles_dir() -> Path:
    """The shipped telemetry bundles, one directory each (``data/bundles/`` in a checkout)."""
    return Path(str(files("xroute.resources.bundles")))


def catalogs_dir() -> Path:
    """The shipped catalogs without a workload (``data/catalogs/`` in a checkout): ``unseen/<bundle>``
    holds offerings no shipped bundle has (``xroute evaluate --swap-offerings``)."""
    return Path(str(files("xroute.resources.catalogs")))


def shipped_bundles() -> list[str]:
    """The names of the shipped bundles (``default``, ...)."""
    return sorted(p.name for p in bundles_dir().iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
