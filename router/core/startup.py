"""What a router's start spends its time on: one clock per process, read from the process's own
start, marked at each phase's end (``xroute serve``, ``RoutingEngine``, the app's lifespan) and
logged with ``router ready`` (``start_s``: seconds per phase, in order; ``started_in_s``: from the
process's start to ready). ``benchmarks/bench_startup.py`` reads it; ``docs/router.md``,
"Start time", has the figures.

The cyclic garbage collector is held off for the start (:func:`hold_gc`, by ``xroute serve`` and
by each of its workers, ``router.app.worker``): a start makes hundreds of thousands of objects that
live as long as the process -- modules, the environment, the model -- which the collector would
otherwise walk again and again as they come. What is made is frozen (out of the collector's reach
for good: never walked again, also not while serving) in three steps: the imports' objects once
imported (:func:`freeze_imports`); the engine, the stores and what else the start built, once
collected (:func:`settle_gc`, before the model loads); and at the end (:func:`release_gc`) the
model's load, frozen without a collection -- mostly MLflow's and SQLAlchemy's modules, imported
then, whose unreachable import-time objects are frozen with them, as the imports' own are, rather
than walked -- and the collector is back on. An app started in a process that never held it (a
test's server thread) collects its young generations and freezes at the end. (What each step
saves: ``docs/results.md``, "Figures behind the code".)

The process's start comes from ``/proc/self/stat`` (Linux: its start time in clock ticks since
boot, against ``CLOCK_BOOTTIME``), so the first phase (``imports``: the interpreter and the modules
loaded before the first mark) is measured too; elsewhere the clock starts when this module is
imported.
"""

from __future__ import annotations

import gc
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
#: whether :func:`hold_gc` turned the collector off (and :func:`release_gc` turns it back on)
_held = [False]


def hold_gc() -> None:
    """No cyclic garbage collection until :func:`release_gc` (module docstring)."""
    if gc.isenabled():
        gc.disable()
        _held[0] = True


def freeze_imports() -> None:
    """After the start's imports, with the collector held: their objects moved out of its reach for good."""
    if _held[0]:
        gc.freeze()


def settle_gc() -> None:
    """With the collector held: what the start built so far collected, and the rest frozen."""
    if _held[0]:
        gc.collect()
        gc.freeze()


def release_gc(only_if_held: bool = False) -> None:
    """The end of the start: everything frozen and the collector back on if :func:`hold_gc` held
    it (module docstring); else the young generations collected and everything frozen.
    ``only_if_held``: nothing unless it is held (a start that failed before its end)."""
    if only_if_held and not _held[0]:
        return
    if not _held[0]:
        gc.collect(1)
    gc.freeze()
    if _held[0]:
        gc.enable()
        _held[0] = False
