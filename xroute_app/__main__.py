"""``python -m xroute_app``: the ``xroute`` command."""

from xroute_app.cli import main

main()
