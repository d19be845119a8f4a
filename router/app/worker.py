"""What each worker of ``xroute serve --workers N`` runs: uvicorn imports this module in the worker
(a spawned interpreter) and calls :func:`app`, which builds the app from the config file and the
environment (``router.app.factory.app_from_environment``: the command put its options there) with the
cyclic garbage collector held off for the start, as the command does for one worker
(``router.core.startup``). The router's modules are imported here, once the collector is held, rather
than by uvicorn before it could be."""

from __future__ import annotations

from typing import Any

from router.core.startup import freeze_imports, hold_gc


def app() -> Any:
    hold_gc()
    from router.app.factory import app_from_environment

    freeze_imports()
    return app_from_environment()
