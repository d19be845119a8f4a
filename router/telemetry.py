"""Where the router's live features come from: a telemetry source, a clock, and their freshness.

The router computes features exactly as the environment does (``CloudRouteEnv.observe_live``), so
what it needs from telemetry is a :class:`~xroute.bundle.Bundle` (catalog, prices, availability,
utilization, RTT) and a mapping from wall-clock time onto telemetry time.

* :class:`ReplaySource` serves a recorded bundle (the default). Its clock *replays*: telemetry time
  = window start + ((wall - start of serving) x ``speed`` + offset) modulo the window, where the
  window is the bundle's workload span. When the clock wraps to the window's start, the router's
  pool-load view is reset (the recorded prices and preemptions start over). Every response says
  which telemetry time it used.
* A live source (cloud adapters writing a rolling bundle) implements the same :class:`TelemetrySource`
  interface; nothing else in the router changes.

Freshness: :meth:`TelemetrySource.poll` is called every ``telemetry_refresh_s``; the *age* reported
with each decision is the wall-clock time since the last successful poll. For the replay source a
poll checks that the bundle's files are still readable (the recording itself never changes).
"""

from __future__ import annotations

import abc
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from xroute.bundle import DEFAULT_BUNDLE, Bundle, load_bundle, to_seconds


def iso(t: float) -> str:
    """Seconds since the epoch as ISO-8601 UTC with milliseconds (``2024-01-01T00:00:00.123Z``).
    Two are formatted per routed request: the part up to the second is cached."""
    frac, whole = math.modf(t)  # rounded to the microsecond first, as datetime.fromtimestamp does
    us = round(frac * 1e6)
    sec = int(whole)
    if us >= 1_000_000:
        sec, us = sec + 1, us - 1_000_000
    elif us < 0:
        sec, us = sec - 1, us + 1_000_000
    ms = us // 1000
    head = _iso_heads.get(sec)
    if head is None:
        if len(_iso_heads) > 64:
            _iso_heads.clear()
        head = _iso_heads[sec] = datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S.")
    return f"{head}{ms:03d}Z"


_iso_heads: dict[int, str] = {}  # a request formats its wall time and its telemetry time


class TelemetrySource(abc.ABC):
    """Telemetry for the router: a bundle, a clock onto its time, and a freshness check."""

    name: str

    @abc.abstractmethod
    def bundle(self) -> Bundle:
        """The telemetry the router's environment reads."""

    @abc.abstractmethod
    def telemetry_time(self, wall: float) -> tuple[float, int]:
        """Telemetry time (epoch seconds) for wall-clock ``wall``, and a generation number that
        changes when time jumps backwards (a replay wrap), so the load view can be reset."""

    @abc.abstractmethod
    def poll(self) -> None:
        """Refresh from the source; raise if it cannot be reached (the cache then grows stale)."""

    @abc.abstractmethod
    def describe_clock(self) -> str: ...


class ReplaySource(TelemetrySource):
    """A recorded bundle replayed in a loop (see the module docstring)."""

    def __init__(self, path: Path | str | None = None, speed: float = 1.0, offset_s: float = 0.0,
                 start_wall: float | None = None):
        self.path = Path(path) if path is not None else DEFAULT_BUNDLE
        self._bundle = load_bundle(self.path)
        t = to_seconds(self._bundle.workload["ts"])
        self.start, self.end = float(t[0]), float(t[-1])
        self.span = max(self.end - self.start, 1.0)
        self.speed = speed
        self.offset_s = offset_s % self.span
        self.start_wall = time.time() if start_wall is None else start_wall
        self.name = f"replay:{self.path.name}"

    def bundle(self) -> Bundle:
        return self._bundle

    def telemetry_time(self, wall: float) -> tuple[float, int]:
        pos = max(wall - self.start_wall, 0.0) * self.speed + self.offset_s
        gen, within = divmod(pos, self.span)
        return self.start + within, int(gen)

    def poll(self) -> None:
        for name in ("offerings", "prices", "rtt"):
            if not any((self.path / f"{name}{s}").is_file() for s in (".csv", ".csv.gz", ".parquet")):
                raise FileNotFoundError(f"{self.path}: table '{name}' is gone")

    def describe_clock(self) -> str:
        return (f"replay x{self.speed:g} of {iso(self.start)}..{iso(self.end)} "
                f"(wraps every {self.span / self.speed:.0f} s; load view reset on wrap)")


@dataclass
class Freshness:
    """When the source last answered, and the last error (for /readyz and the logs)."""

    last_ok_wall: float
    last_error: str | None = None

    def age(self, wall: float) -> float:
        return max(0.0, wall - self.last_ok_wall)
