"""Collecting on a schedule: a run every N seconds, start to start, until a run count or a stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cloud_adapters.collect.config import CollectConfig
from cloud_adapters.collect.run import Collector, CollectReport
from xroute.errors import XrouteError


def collect_every(config: CollectConfig, every_s: float, *, max_runs: int | None = None,
                  on_report: Callable[[CollectReport], None] | None = None,
                  on_event: Callable[[str, str, str], None] | None = None,
                  on_error: Callable[[Exception], None] | None = None,
                  stop: threading.Event | None = None) -> int:
    """Collect every ``every_s`` seconds (start to start) until ``max_runs`` or ``stop``; returns the
    number of runs. When repeating, a run that fails as a whole (the directory locked, a bad table,
    a full disk) goes to ``on_error`` and the loop goes on; a single run raises."""
    collector = Collector(config)
    stop = stop or threading.Event()
    runs = 0
    next_start = time.monotonic()
    while not stop.is_set() and (max_runs is None or runs < max_runs):
        try:
            report = collector.run(on_event)
        except (XrouteError, OSError) as e:
            if max_runs == 1 or on_error is None:
                raise
            on_error(e)
        else:
            if on_report:
                on_report(report)
        runs += 1
        next_start += every_s
        if max_runs is not None and runs >= max_runs:
            break
        stop.wait(max(0.0, next_start - time.monotonic()))
    return runs
