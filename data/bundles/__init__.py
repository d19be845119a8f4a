# Makes data/bundles/ the package xroute.resources.bundles in an install (pyproject.toml, package-dir):
# the shipped bundles are read through importlib.resources, wherever xroute is installed.
