"""The app layer: the ``xroute`` command line, which mounts every package's commands.

It sits above all of xroute's packages and may import any of them; nothing imports it (the import
contracts in ``pyproject.toml``, ``docs/architecture.md``). ``python -m xroute_app`` runs it as the
``xroute`` script does.
"""
