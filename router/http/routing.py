"""A Starlette ``Route`` that names itself in the scope as FastAPI's routes do, for the routes served
outside FastAPI's ``APIRoute`` machinery (``POST /v1/route``, the gateway's)."""

from __future__ import annotations

from starlette.routing import Match, Route
from starlette.types import Scope


class ServedRoute(Route):
    """A Starlette ``Route`` that names itself in the scope as FastAPI's routes do (``scope["route"]``:
    the access log and the error counters label requests by its path)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is not Match.NONE:
            child["route"] = self
        return match, child
