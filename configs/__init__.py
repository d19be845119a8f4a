# Makes configs/ the package xroute.resources.configs in an install (pyproject.toml, package-dir):
# the shipped YAML is read through importlib.resources, wherever xroute is installed.
