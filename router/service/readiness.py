"""What ``/readyz`` answers, kept current in the background whatever the traffic.

Every worker probes both backends every ``ready_probe_s`` (0.5 s) -- whatever its own traffic, so
a worker with no requests, or one whose neighbour saw the failure, still answers what holds --
the decision log (``GroupCommitLog.healthy``: on PostgreSQL a query on the server, which also
drops idle connections the server closed; on SQLite whether its writer process is alive) and the
shared state (``Health.healthy``, ``router.service.ports``: a Redis ``PING`` within ``state_timeout_s``) -- at the same
time, so one slow backend does not delay the other's verdict. ``/readyz`` answers from what was
seen last of each backend: the last probe, or a request since (a commit or a state operation that
failed, or succeeded, after it: ``GroupCommitLog.error``, ``Health.error``). Measured
(``tests/test_router_drill.py``, ``docs/router.md``): ``/readyz`` turns 503 within about a probe
interval of PostgreSQL stopping and 200 again within about one of its return.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from router.core.logs import LOG, flush_logs
from router.core.text import one_line
from router.service.ports import Health
from router.store.sqlite import GroupCommitLog


class Readiness:
    """The backends' health as last seen (module docstring): by the probe, or by a request since."""

    def __init__(self, store: GroupCommitLog, state: Health, every_s: float):
        self.store, self.state, self.every_s = store, state, every_s
        self._was = (True, True)
        self.probed_at: float | None = None

    @property
    def decision_log_ok(self) -> bool:
        """The decision log as last seen: by the last probe, or a commit since (either sets or
        clears ``GroupCommitLog.error``)."""
        return self.store.error is None and not self.store.closed

    @property
    def state_ok(self) -> bool:
        """The shared state as last seen: by the last probe, or an operation since (``Health.error``)."""
        return self.state.error is None

    async def probe(self) -> None:
        """Both backends at once (each ``healthy`` records what it found in the backend's ``error``)."""
        await asyncio.gather(self.store.healthy(), self.state.healthy(), return_exceptions=True)
        now = (self.decision_log_ok, self.state_ok)
        for name, before, ok, detail in (("decision log", self._was[0], now[0], self.store.error),
                                         ("shared state", self._was[1], now[1], self.state.error)):
            if before != ok:
                fields: dict[str, Any] = {"backend": name, **({"error": detail} if detail else {})}
                if ok:
                    LOG.info(f"{name} reachable again: ready", extra={"fields": fields})
                else:
                    LOG.warning(f"{name} down: not ready", extra={"fields": fields})
                flush_logs()
        self._was = now
        self.probed_at = time.time()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.probe()
            except Exception as e:  # never stop probing
                LOG.warning("readiness probe failed", extra={"fields": {"error": one_line(e)}})
