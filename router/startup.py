"""What a router's start spends its time on: one clock per process, read from the process's own
start, marked at each phase's end (``xroute serve``, ``RoutingEngine``, the app's lifespan) and
logged with ``router ready`` (``start_s``: seconds per phase, in order; ``started_in_s``: from the
process's start to ready). ``benchmarks/bench_startup.py`` reads it; ``docs/router.md``,
"Start time", has the figures.

The process's start comes from ``/proc/self/stat`` (Linux: its start time in clock ticks since
boot, against ``CLOCK_BOOTTIME``), so the first phase (``imports``: the interpreter and the modules
loaded before the first mark) is measured too; elsewhere the clock starts when this module is
imported.
"""

from __future__ import annotations

import os
import time
from typing import Any


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), or None where ``/proc`` cannot say."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # the fields after the command (in parentheses, which may hold spaces): field 22 is starttime
        started = int(stat[stat.rindex(b")") + 2:].split()[19]) / os.sysconf("SC_CLK_TCK")
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartClock:
    """Seconds per phase of this process's start, in the order marked (a phase marked twice adds up)."""

    def __init__(self) -> None:
        age = process_age_s()
        self._last = time.perf_counter() - (age or 0.0)
        self._origin = self._last
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> float:
        """End ``phase`` now (it began at the previous mark, or at the process's start); returns its seconds."""
        now = time.perf_counter()
        spent = now - self._last
        self.phases[phase] = self.phases.get(phase, 0.0) + spent
        self._last = now
        return spent

    def skip(self) -> None:
        """Start the next phase now, leaving the time since the last mark out of every phase."""
        self._last = time.perf_counter()

    def report(self) -> dict[str, Any]:
        """``started_in_s`` (process start to now) and ``start_s`` (the phases), in seconds, to the millisecond."""
        return {"started_in_s": round(time.perf_counter() - self._origin, 3),
                "start_s": {k: round(v, 3) for k, v in self.phases.items()}}


#: this process's clock
CLOCK = StartClock()
