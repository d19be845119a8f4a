# Makes data/catalogs/ the package xroute.resources.catalogs in an install (pyproject.toml, package-dir):
# catalogs without a workload (unseen/<bundle>: offerings no shipped bundle has), read through importlib.resources.
