"""The watchdog's verdicts shared across router processes through the audit log
(``router.decision.watchdog``; docs/ope.md, "The watchdog").

A trip and a reset are each one audit entry (kind ``watchdog``, action ``trip`` or ``reset``,
resource the champion version, ``after`` the state with the process that made it, ``by``), written
by the process that tripped or was reset -- durable before a reset is answered. Every process
reads the new entries every ``watchdog.sync_s`` (:func:`follow`) and applies the others': a trip of
the champion it serves trips it too (greedy decides on every router within about ``sync_s``), a
reset of it starts its confidence sequence again. Each process keeps the last verdict per version,
so a process that loads that version later (a new worker, a restart) starts from it. The estimates
themselves stay per process.
"""

from __future__ import annotations

import asyncio
from typing import Any

from router.core.logs import LOG
from router.service.services import Services
from router.store import audit


def _store(svc: Services) -> Any:
    sync = svc.policies
    return None if sync is None else sync.store


async def record(svc: Services, action: str, principal: str, before: Any, after: dict[str, Any]) -> None:
    """One audit entry of the watchdog (``action``: trip or reset) for the version it watches,
    committed before this returns; raises what the store raises (no store: RuntimeError)."""
    store = _store(svc)
    if store is None:
        raise RuntimeError("the audit log is not open")
    wd = svc.engine.watchdog
    entry = {**after, "by": wd.token}

    def write() -> None:
        with store.db.transaction() as execute:
            audit.append(execute, principal, [audit.Change(action, "watchdog", str(wd.version), before, entry)], None)

    await asyncio.to_thread(write)


async def tripped(svc: Services) -> None:
    """This process's watchdog just tripped: the trip is recorded for the others (a failure to
    record is logged; this process serves greedy anyway)."""
    try:
        await record(svc, "trip", "router", None, svc.engine.watchdog.describe())
    except Exception as e:
        LOG.warning("the watchdog's trip is not shared with the other routers (the audit log cannot record it)",
                    extra={"fields": {"error": f"{type(e).__name__}: {e}"}})


async def follow(svc: Services, every_s: float) -> None:
    """Apply the other processes' trips and resets (module docstring), every ``every_s``."""
    wd = svc.engine.watchdog
    store = _store(svc)
    if store is None or not wd.enabled:
        return
    after = 0
    while True:
        try:
            entries = await asyncio.to_thread(store.audit, "watchdog", None, after, 1000)
            for e in entries:
                after = max(after, int(e["audit_id"]))
                wd.shared_verdict(str(e["resource"]), str(e["action"]), e["after"] or {})
        except Exception as e:  # (the log unreachable: try again next time)
            LOG.warning("the watchdog cannot read the other routers' verdicts", extra={"fields": {
                "error": f"{type(e).__name__}: {e}"}})
        await asyncio.sleep(every_s)
